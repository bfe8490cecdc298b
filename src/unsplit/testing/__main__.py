"""The worker entry of :func:`unsplit.testing.run_local_processes` (``python -m unsplit.testing``)."""

from unsplit._src.processes.launch import worker_main

if __name__ == "__main__":
    worker_main()
