//! Allocation trace formats (CSV, PyTorch snapshot pickles, RMM logs), replay and metrics.
