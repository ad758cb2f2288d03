"""`python -m infer.serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

Endpoints: POST /v1/completions and /v1/chat/completions (`stream: true` sends server-sent events
ending in `data: [DONE]`, with `stream_options.include_usage`), GET /v1/models, /health and
/metrics (Prometheus). Every request runs as one row of the engine's batch
(`dflash_jax.engine.streaming`) with its own max_tokens, temperature, top_p, top_k and seed, so
greedy and sampled requests share a batch and nothing recompiles after start-up. Tokens reach
the client at every sync of the engine (`--sync-every` cycles).

A thin edge: it parses requests, turns them into token ids and engine requests, and turns the
engine's tokens back into text and OpenAI's response schema. Its modules:

- `__main__`: the flags (`build_parser`) and `main`: start-up, the loading thread, exit statuses.
- `app`: `create_app`, wiring only: routes, dependencies, error handlers, shutdown, and what every
  request passes before it is read (the API key, the body's size and read deadline).
- `handlers`: one function per endpoint, the warming-up check, `submit` to the engine.
- `protocol`: OpenAI's wire format as pydantic models (requests, responses, the error body) and
  the mapping of validation errors to a 400 in that error schema (`APIError`).
- `prepare`: a validated request turned into what the engine runs (`PreparedRequest`).
- `structured`: a request's constraint (`response_format`, `structured_outputs`, a required tool call),
  compiled in the request's thread.
- `model`: `ServedModel`, the model served: flags checked, weights loaded, programs compiled,
  the engine started; text to token ids and back.
- `streaming`: a row's text released as it grows (`StreamedText`: stop strings, UTF-8 hold-back), the
  whole answer (`collect`, `response`) and the server-sent events (`event_stream`).
- `logprobs`: a choice's logprobs in chat's and completions' shapes (token strings and bytes).
- `metrics`: /metrics in Prometheus's text format.
- `toolcalls/`: tool calls: the formats' parsers and call patterns, and a request's tools checked.
"""
