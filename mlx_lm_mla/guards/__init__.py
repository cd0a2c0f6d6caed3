"""Guards on ``mlx_lm.server``, so that no request and no fault leaves the
server worse than a fresh one: ``requests`` (a request checked where it
enters), ``reuse`` (the prompt cache shared across requests), ``recovery``
(the generation loop after a failure), ``cancellation`` (a request whose
client left) and ``sampling`` (a request's sampler and logits processors). ``patches/server.py`` applies them."""
