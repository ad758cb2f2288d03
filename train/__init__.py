"""Drafter training: `python -m train`, `python -m train.generate_data`, `python -m train.export`.

`cli` (the flags, dispatching to `trainer`, the training loop, or with --aot to `aot`, the step
compiled for a TPU), `config` (the YAML configuration and its overrides), `verdict` (what a run's
eval tau means), `generate_data` (the target regenerates a prompt set's responses), `export` (a
trained drafter to the z-lab HF format); the bundled demo pair's build scripts: `demo_prompts`,
`demo_target`.
"""
