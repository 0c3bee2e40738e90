"""Published reference data (benchmark definitions and results) that the experiments,
the sweeps and the reports all read: data only, below every other package."""
