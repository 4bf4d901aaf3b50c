"""The comparison page: one data document built from the store (runs, registry, sweeps),
rendered into a self-contained HTML file or served by `trainyard ui`. No Prefect here."""
