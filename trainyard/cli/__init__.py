"""The `trainyard` command. Imports Prefect and the flows only inside commands that run them."""
