"""The demo upstream (and, later, the crash-recovery lab)."""
