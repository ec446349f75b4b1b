"""The `moe-bench` suites: benchmarks that time the product's own code paths beside their peers.

They live above the packages they measure (launch -> {moe, pipeline, optim} -> dispatch -> kernels),
so moe, dispatch, pipeline, optim and kernels hold only what the product runs.

Adding a suite:
1. Write launch/bench/NAME.py with `main(argv: list[str]) -> int` that parses its own options
   (argparse, prog="moe-bench NAME"), returns 0 on success and non-zero when a correctness check fails.
2. Spawn ranks only through `launch.parallel.spawn.run_processes`, via `launch.bench.progress.run_ranks`,
   which adds the per-call time budget (`call_budget` in the workers) and its clear stop message;
   show progress with `launch.bench.progress.BenchProgress`.
3. Print and save through `launch.bench.report`: `table` for the text table and `write_json`, which puts
   the common header (machine, versions, command line, git commit) above the rows and names the row
   key and the timed metrics, so `moe-bench compare OLD.json NEW.json` works on the suite unchanged.
4. Add the name to SUITES in launch/bench/cli.py (a name whose module is absent is not offered).
Keep the default run within a few minutes on a 2-core CPU; scale shapes to the machine and say so.
"""
