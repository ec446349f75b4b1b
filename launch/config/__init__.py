"""The typed, documented settings of a run, read from one TOML file: run (RunConfig, reading and overrides),
sections ([train], [data], [parallel], [optim]; [model] is moe.config's), ops ([ops]), checks (the checks
across sections)."""
