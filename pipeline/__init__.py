"""Pipeline parallelism: schedules as data, DualPipe/DualPipeV runtime, simulator."""
