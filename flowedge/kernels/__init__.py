"""Native CPU kernels built on first use (see build.py); torch's kernels are the fallback."""
