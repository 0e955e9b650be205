"""The runtime: router, group schedulers, workers, state managers (mechanism; decisions live in plexrl.policy)."""
