"""`python -m infer`: batch generation with DFlash speculative decoding (see `infer.cli`).

`flags`: its flags and the job they describe (the engine's flags, shared with the server and the
bench); `job_output`: what a job shows; `serve`: `python -m infer.serve`, the OpenAI-compatible
server; `bench`: `python -m infer.bench`, the old name of `python -m bench`.
"""
