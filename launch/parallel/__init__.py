"""Where each rank stands in the layout: the process groups (mesh), its device, the stages it holds, where each
parameter lives (placement), and the spawner that starts local ranks (spawn)."""
