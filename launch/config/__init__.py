"""[run], [model] ... : the typed, documented settings of a run, read from one TOML file (run: the sections and
RunConfig; ops: [ops])."""
