"""The runtime's own work per speculative round and its host reads, on a small random target: a thin
wrapper over ``headway.bench.runtime_probe``; see that module for the options and what it measures."""

from headway.bench.runtime_probe import main

if __name__ == "__main__":
    main()
