"""``mlx-lm-mla tiny-model DIR``, and the README's "Try it in a minute": its
commands run as written, on a real ``mlx_lm.server``, with and without the fix."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import mlx_lm
import pytest
from mlx_lm.sample_utils import make_logits_processors

from mlx_lm_mla import tiny
import conftest
from serving import free_port, server_supports, wait_until_up

README = Path(__file__).resolve().parents[1] / "README.md"
SWAPAXES = "AttributeError: " + conftest.SWAPAXES


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``mlx-lm-mla tiny-model DIR`` run once: (DIR, its output)."""
    path = tmp_path_factory.mktemp("tiny") / "glm"
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm_mla", "tiny-model", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return path, out.stdout


def test_it_writes_a_model_mlx_lm_load_reads_with_its_chat_template(written):
    path, stdout = written
    assert f"to {path}" in stdout
    model, tokenizer = mlx_lm.load(str(path))
    assert model.model_type == "glm4_moe_lite"
    assert model.args.kv_lora_rank == tiny.DEMO_WIDTHS["kv_lora_rank"]
    assert model.args.qk_rope_head_dim == tiny.DEMO_WIDTHS["qk_rope_head_dim"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|user|>\nHi<|endoftext|>\n<|assistant|>\n"


def test_the_model_is_as_small_as_the_readme_says(written):
    size = sum(p.stat().st_size for p in written[0].iterdir()) / 1000
    said = int(re.search(r"\((\d+) KB, no download\)", README.read_text()).group(1))
    assert abs(size - said) <= 0.05 * said


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_every_mla_model_type_generates_past_quantized_kv_start(
    tmp_path, model_type, installed
):
    path = tiny.save_demo_model(tmp_path / model_type, model_type)
    model, tokenizer = mlx_lm.load(str(path))
    no_end = make_logits_processors(logit_bias={tiny.EOS_TOKEN_ID: -100.0})
    *_, last = mlx_lm.stream_generate(
        model,
        tokenizer,
        "Hello",
        max_tokens=24,
        kv_bits=4,
        quantized_kv_start=16,
        logits_processors=no_end,
    )
    assert last.prompt_tokens + last.generation_tokens > 16
    assert last.generation_tokens == 24 and last.finish_reason == "length"


def refused(capsys, *args):
    """What ``mlx-lm-mla tiny-model ARGS`` says when it refuses them."""
    with pytest.raises(SystemExit) as exit:
        tiny.main([str(a) for a in args])
    assert exit.value.code == 2
    return capsys.readouterr().err


def test_a_folder_with_files_is_refused_and_left_alone(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert "exists and is not an empty folder" in refused(capsys, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_an_unknown_model_type_is_refused_by_name(tmp_path, capsys):
    said = refused(capsys, tmp_path / "m", "--model-type", "llama")
    assert "invalid choice: 'llama'" in said
    assert not (tmp_path / "m").exists()


def test_a_negative_seed_is_refused_by_name(tmp_path, capsys):
    said = refused(capsys, tmp_path / "m", "--seed", "-1")
    assert "argument --seed: expected a whole number from 0 to 2**64 - 1" in said
    assert not (tmp_path / "m").exists()


def test_a_folder_that_cannot_be_made_is_refused_with_why(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    said = refused(capsys, tmp_path / "file" / "m")
    assert f"error: cannot make the folder {tmp_path / 'file' / 'm'}: " in said
    assert os.strerror(errno.ENOTDIR) in said
    assert (tmp_path / "file").read_text() == "mine"


# --- the README -------------------------------------------------------------------


def try_it():
    """The README's "Try it in a minute": (its text, the commands before the
    server's, the server's, the client's)."""
    section = README.read_text().split("## Try it in a minute", 1)[1]
    section = section.split("\n## ", 1)[0]
    lines = re.search(r"```\n(.*?)```", section, re.S).group(1).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("mlx_lm.server "))
    client = [line for line in lines[at + 1 :] if not line.startswith("#")]
    return section, "\n".join(lines[:at]), lines[at], "\n".join(client)


def shell(script, cwd, env, **kw):
    return subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, **kw
    )


def answers(stdout):
    """The JSON replies curl printed, one after the other."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(stdout):
        value, at = decoder.raw_decode(stdout, at)
        found.append(value)
    return found


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """Runs the README's commands in a folder of their own; the port is a
    free one instead of 8080, so that runs side by side do not meet."""
    section, setup, server, client = try_it()
    folder = tmp_path_factory.mktemp("try-it")
    scripts = sysconfig.get_paths()["scripts"]
    env = {k: v for k, v in os.environ.items() if k != "MLX_LM_MLA_DISABLE"}
    env["PATH"] = f"{scripts}:{env['PATH']}"
    made = shell(setup, folder, env, timeout=300)
    assert made.returncode == 0, made.stderr

    def run(prefix="", flags=""):
        """(the client's output, the server's log) for the server command
        started with prefix, and flags added."""
        port, log = str(free_port()), folder / f"server{prefix.strip()}.log"
        command = prefix + server.replace("8080", port) + flags
        with open(log, "w+") as out:
            proc = subprocess.Popen(
                ["bash", "-c", command],
                cwd=folder,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                wait_until_up(proc, port, out)
                replies = shell(client.replace("8080", port), folder, env, timeout=300)
            finally:
                stop_group(proc)
        return replies, log.read_text()

    run.section = " ".join(section.split())  # as read, whatever the line breaks
    run.folder, run.env = folder, env
    return run


def stop_group(proc, grace=30):
    """Terminates a process group (the server and any shell around it); kills
    it after ``grace`` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


KV_BITS = server_supports("--kv-bits")


@pytest.mark.skipif(not KV_BITS, reason="this mlx_lm.server has no --kv-bits")
def test_the_readme_try_it_serves_two_turns_past_quantized_kv_start(readme_run):
    replies, log = readme_run()
    assert replies.returncode == 0, replies.stderr
    first, second = answers(replies.stdout)
    start = int(re.search(r"--quantized-kv-start (\d+)", try_it()[2]).group(1))
    said = int(re.search(r'"cached_tokens": (\d+)', readme_run.section).group(1))
    for reply in (first, second):
        assert reply["usage"]["total_tokens"] > start
        assert reply["usage"]["completion_tokens"] == 100
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == said
    assert "swapaxes" not in log


@pytest.mark.skipif(not KV_BITS, reason="this mlx_lm.server has no --kv-bits")
def test_the_readme_disk_try_it_writes_the_files_it_says(readme_run):
    text = README.read_text().split("## Prompt caches on disk", 1)[1]
    text = " ".join(text.split("\n## ", 1)[0].split())
    flags = re.search(r"server line, add `([^`]+)`", text).group(1)
    stats, files = re.search(
        r"`(mlx-lm-mla cache-dir stats \S+)` lists their (\d+)", text
    ).groups()
    replies, _ = readme_run(flags=" " + flags)
    assert replies.returncode == 0, replies.stderr
    out = shell(stats, readme_run.folder, readme_run.env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f": {files} cache files," in out.stdout


@pytest.mark.skipif(not KV_BITS, reason="this mlx_lm.server has no --kv-bits")
def test_the_readme_try_it_without_the_fix_fails_as_it_says(readme_run):
    replies, log = readme_run("MLX_LM_MLA_DISABLE=1 ")
    assert "MLX_LM_MLA_DISABLE=1 mlx_lm.server" in readme_run.section
    assert replies.stdout == ""
    empty = "curl: (52) Empty reply from server"
    assert replies.stderr.count(empty) == 2 and empty in readme_run.section
    assert SWAPAXES in log and SWAPAXES in readme_run.section


@pytest.mark.skipif(KV_BITS, reason="this mlx_lm.server has --kv-bits")
def test_the_readme_says_which_server_has_no_kv_bits(tmp_path):
    section, _, server, _ = try_it()
    said = re.search(r"\(mlx-lm ([\d.]+): no `--kv-bits`\)", " ".join(section.split()))
    assert said and mlx_lm.__version__.startswith(said.group(1) + ".")
    scripts = sysconfig.get_paths()["scripts"]
    env = {**os.environ, "PATH": f"{scripts}:{os.environ['PATH']}"}
    out = shell(server, tmp_path, env, timeout=120)
    assert out.returncode == 2 and "unrecognized arguments: --kv-bits" in out.stderr
