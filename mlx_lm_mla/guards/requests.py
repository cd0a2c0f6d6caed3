"""Guards on ``mlx_lm.server``'s HTTP side: bad input gets a 400 naming the field
before it reaches a shared batch, and every failure one well-formed status."""

import json
import logging
import math
import os

from . import cancellation, sampling
from . import state as served

logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the server cannot serve as sent; answered with HTTP 400."""


def request_problem(request, stop_words, logit_bias):
    """Why a request cannot be served, from the request alone, or None."""
    kind = request.request_type
    if kind == "text":
        prompt = request.prompt
        if not isinstance(prompt, str) or not prompt:
            return "prompt must be a non-empty string"
    elif kind == "chat":
        messages = request.messages
        if not isinstance(messages, list) or not messages:
            return "messages must be a non-empty list"
        if not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            return "messages must be objects with a string role"
        for i, m in enumerate(messages):
            problem = content_problem(m.get("content"))
            if problem:
                return f"messages[{i}].content{problem}"
    if not isinstance(stop_words, list) or not all(
        isinstance(w, str) and w for w in stop_words
    ):
        return "stop must be a non-empty string or a list of non-empty strings"
    if logit_bias and any(i < 0 for i in logit_bias):
        return "logit_bias token ids must not be negative"
    return None


def content_problem(content):
    """Why a message's content is not a string, null or a list of content parts,
    from the field's path on, or None."""
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, list):
        return (
            " must be a string, null or a list of content parts, "
            f"not {type(content).__name__}"
        )
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            return f"[{j}] must be an object with a string type"
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            return f"[{j}].text must be a string"
    return None


# The most tokens one request may ask for (MLX_LM_MLA_MAX_TOKENS).
CEILING = 1 << 20


def _language_args(model):
    """The language model's arguments: the model's own, or a wrapper's
    ``text_config`` object (Kimi-VL, Kimi K2.5); where that is a dict
    (mistral3), the arguments its language model was built from, as that
    model's class read them (mistral4's rope_parameters over rope_scaling)."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    if isinstance(text, dict):
        return getattr(getattr(model, "language_model", None), "args", None)
    return args if text is None else text


def context_length(model):
    """The tokens the model's positions reach, or None where its config does not
    say: ``max_position_embeddings``, or where RoPE scaling stretches it past
    that, its original length times the factor (Qwen's YaRN set-up keeps the
    unscaled length there; DeepSeek's gives the scaled one)."""
    args = _language_args(model)
    length = getattr(args, "max_position_embeddings", None)
    scaling = getattr(args, "rope_scaling", None)
    if scaling is None:  # ministral3 keeps its YaRN set-up in rope_parameters only
        scaling = getattr(args, "rope_parameters", None)
    if not isinstance(length, int):
        return None
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if isinstance(factor, (int, float)) and factor > 1:
        original = scaling.get("original_max_position_embeddings", length)
        if isinstance(original, int):
            length = max(length, int(original * factor))
    return length


def max_tokens_limit(generator, prompt_tokens):
    """(the most tokens the request may generate, why): the lower of the context
    the prompt leaves and the ceiling."""
    try:
        ceiling = int(os.environ.get("MLX_LM_MLA_MAX_TOKENS", CEILING))
    except ValueError:
        logger.warning(
            "mlx-lm-mla: MLX_LM_MLA_MAX_TOKENS is not an integer; using %d", CEILING
        )
        ceiling = CEILING
    context = context_length(generator.model_provider.model)
    if context is not None and context - prompt_tokens < ceiling:
        return max(context - prompt_tokens, 0), (
            f"the model's context is {context} tokens "
            f"and the prompt has {prompt_tokens}"
        )
    return ceiling, "the server's ceiling (MLX_LM_MLA_MAX_TOKENS)"


def non_finite(value, path=""):
    """The path of the first NaN or infinite number in a JSON body (Python's json
    reads them), or None. A loop, not recursion: a body json could parse may
    be nested nearly as deep as the interpreter's stack."""
    pending = [(value, path)]
    while pending:
        value, path = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path or "body"
        if isinstance(value, dict):
            items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        pending.extend(reversed([(v, where) for where, v in items]))
    return None


def checked_tokenize(original, server):
    """``ResponseGenerator._tokenize`` that refuses, before the request joins a
    batch, what needs the model to see: an empty prompt, too many ``max_tokens``,
    ``logit_bias`` ids outside the vocabulary (upstream applies them to whatever
    memory they point at), and sampling its own builders cannot run with."""

    def _tokenize(self, tokenizer, request, args, *rest, **kwargs):
        result = original(self, tokenizer, request, args, *rest, **kwargs)
        # The sampler and processors find the request's state by its args.
        state = served.of(self.model_provider).requests.bind_to(request, args)
        problem = tokens_problem(self, server, tokenizer, args, result[0], state)
        if problem:
            if state is not None:  # its handler answers 400, not upstream's 404
                state.refused = problem
            raise BadRequest(problem)
        return result

    _tokenize.mlx_lm_mla_original = original
    return _tokenize


def tokens_problem(generator, server, tokenizer, args, prompt, state):
    """Why a tokenized request cannot be served, or None."""
    if not prompt:
        return "prompt has no tokens"
    limit, why = max_tokens_limit(generator, len(prompt))
    asked = args.max_tokens
    # The server's own --max-tokens is not the client's to answer for.
    sent = state is None or state.max_tokens_sent
    if sent and isinstance(asked, int) and asked > limit:
        return f"max_tokens must be at most {limit}: {why}"
    bias = args.logits.logit_bias
    size = _vocabulary(generator, tokenizer)
    if bias and size and max(bias) >= size:
        return (
            f"logit_bias token id {max(bias)} is outside the vocabulary (0..{size - 1})"
        )
    if not size:
        return None
    return sampling.sampling_problem(
        sampling.unguarded(server._make_sampler),
        sampling.unguarded(server._make_logits_processors),
        tokenizer,
        args,
        size,
        prompt,
        state,
    )


def _vocabulary(generator, tokenizer):
    # The logits' width: the model's vocabulary, else the tokenizer's.
    size = getattr(_language_args(generator.model_provider.model), "vocab_size", None)
    if isinstance(size, int):
        return size
    try:
        return len(tokenizer._tokenizer)
    except (AttributeError, TypeError):
        return None


def _reply(handler, status, message):
    # mlx-lm's own error body: {"error": "..."}.
    body = json.dumps({"error": message}).encode()
    # Stock's status line and headers: JSON, and CORS as --allowed-origins says.
    handler._set_completion_headers(status)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
    handler.wfile.flush()


def guarded_completion(original):
    """``APIHandler.handle_completion`` that refuses a bad request with 400 before
    it is queued, honours ``"cache_prompt": false``, ends the request when its
    client leaves, and answers a failure during generation with one 500 (or an
    ``error`` event when streaming): upstream lets the exception out after
    buffering a 200, so the client got two status lines."""

    def handle_completion(self, request, stop_words, *args, **kwargs):
        problem = request_problem(request, stop_words, self.logit_bias)
        where = non_finite(self.body)
        if where:
            problem = f"{where} must be a finite number, not NaN or infinity"
        if problem:
            return _reply(self, 400, problem)
        server = served.of(self.response_generator.model_provider)
        requests = server.requests
        state = requests.open(request)
        requests.bind(self, state)  # its header setter finds it by the handler
        body = self.body
        state.cache_prompt = not (
            isinstance(body, dict) and body.get("cache_prompt", True) is False
        )
        state.max_tokens_sent = isinstance(body, dict) and (
            "max_tokens" in body or body.get("max_completion_tokens") is not None
        )
        try:
            with cancellation.watch(self, state):
                return original(self, request, stop_words, *args, **kwargs)
        except (cancellation.ClientGone, *cancellation.GONE):
            return cancellation.ended(self, state)  # nobody to answer
        except Exception as e:
            logger.warning("mlx-lm-mla: request failed: %s: %s", type(e).__name__, e)
            message = f"{type(e).__name__}: {e}"
            try:
                # http.server makes the buffer at the first header it buffers.
                if getattr(self, "_headers_buffer", None):
                    self._headers_buffer = []  # the 200 that was not sent
                    _reply(self, 500, message)
                elif self.stream:
                    self.wfile.write(
                        f"data: {json.dumps({'error': message})}\n\n".encode()
                    )
                    self.wfile.flush()
            except OSError:
                pass  # the client is gone
        finally:
            requests.close(request)
            server.close_replies(state)

    handle_completion.mlx_lm_mla_original = original
    return handle_completion


def bad_request_status(original):
    """``APIHandler._set_completion_headers``: upstream answers every error
    of ``generate()`` with 404; a request refused as the client's (its state
    says so, set where it was refused) gets 400."""

    def _set_completion_headers(self, status_code=200):
        if status_code == 404:
            server = served.of(self.response_generator.model_provider)
            state = server.requests.get(self)
            if state is not None and state.refused is not None:
                status_code = 400
        return original(self, status_code)

    _set_completion_headers.mlx_lm_mla_original = original
    return _set_completion_headers


# The fields mlx-lm reads as integers. Its check is ``isinstance(v, int)``,
# which a JSON bool passes: ``top_logprobs: true`` fails the batch it joins.
INTEGER_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "top_k",
    "num_draft_tokens",
    "repetition_context_size",
    "presence_context_size",
    "frequency_context_size",
    "top_logprobs",
    "seed",
)


def parameters_problem(body):
    """Why a body's fields are of a kind mlx-lm's own checks let through but
    cannot serve, or None: a bool for an integer, a ``logit_bias`` value that
    ``float`` cannot take (upstream's TypeError would be a 500)."""
    if not isinstance(body, dict):
        return None
    for name in INTEGER_FIELDS:
        if isinstance(body.get(name), bool):
            return f"{name} must be an integer, not {json.dumps(body[name])}"
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        for token, value in bias.items():
            try:
                float(value)
            except (TypeError, ValueError):
                where = f"logit_bias[{json.dumps(token)}]"
                return f"{where} must be a number, not {_kind(value)}"
    return _shape_problem(body)


# Keywords the server passes the chat template itself: a request's own
# chat_template_kwargs naming one fails in the template call (upstream's 404).
TEMPLATE_OWN = ("conversation", "tools", "tokenize", "add_generation_prompt")


def _shape_problem(body):
    # Fields upstream reads as objects or lists and fails on otherwise.
    options = body.get("stream_options")
    if options is not None and body.get("stream"):  # upstream reads it then only
        if not isinstance(options, dict):
            return f"stream_options must be an object, not {_kind(options)}"
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            return f"stream_options.include_usage must be true or false, not {_kind(usage)}"
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        return "tools must be a list of objects"
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            return f"chat_template_kwargs must be an object, not {_kind(kwargs)}"
        taken = [k for k in TEMPLATE_OWN if k in kwargs]
        if taken:
            return f"chat_template_kwargs must not set {taken[0]}: the server sets it"
        if kwargs.get("continue_final_message"):  # the template refuses the pair
            return (
                "chat_template_kwargs.continue_final_message cannot be true: the "
                "server asks the template for a generation prompt"
            )
    return None


def _kind(value):
    # A JSON value's kind, as a client sent it.
    kinds = {type(None): "null", list: "an array", dict: "an object", str: "a string"}
    kinds[bool] = "a boolean"
    return kinds.get(type(value), type(value).__name__)


def refused_parameters(original):
    """``APIHandler.validate_model_parameters``, whose refusals are the
    client's: a ``BadRequest`` (mlx-lm 0.32 answers its ValueError with 400
    itself; 0.31 lets it out of ``do_POST``), and what its checks let through
    but cannot serve, refused first."""

    def validate_model_parameters(self):
        problem = parameters_problem(getattr(self, "body", None))
        if problem:
            raise BadRequest(problem)
        options = self.stream_options
        if isinstance(options, dict) and options.get("include_usage") is None:
            # OpenAI's default; upstream indexes the key (a KeyError mid-stream).
            self.stream_options = {**options, "include_usage": False}
        try:
            return original(self)
        except BadRequest:
            raise
        except ValueError as e:
            raise BadRequest(str(e)) from e

    validate_model_parameters.mlx_lm_mla_original = original
    return validate_model_parameters


def answered_post(original):
    """``APIHandler.do_POST`` where every failure gets one status: 400 for a body
    that is not UTF-8 or nested too deeply to parse (upstream closes with no
    reply) or a refused field, else 500."""

    def do_POST(self):
        try:
            return original(self)
        except UnicodeDecodeError as e:
            _reply(self, 400, f"request body is not valid UTF-8: {e}")
        except BadRequest as e:
            _reply(self, 400, str(e))
        except Exception as e:
            # json's decoder names what it was decoding when the stack ran out.
            if isinstance(e, RecursionError) and "JSON" in str(e):
                return _reply(self, 400, "request body is nested too deeply to parse")
            logger.exception("mlx-lm-mla: request failed in the server")
            try:
                _reply(self, 500, f"{type(e).__name__}: {e}")
            except OSError:
                pass  # the client is gone

    do_POST.mlx_lm_mla_original = original
    return do_POST
