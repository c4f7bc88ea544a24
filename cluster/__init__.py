"""The control plane: job store, build DAG, leases and the scheduler that dispatches to Ray."""
