//! Index-based lock-free free lists (tagged Treiber stack, transfer stack, per-thread front caches), loom-verified.
