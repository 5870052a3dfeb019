"""Side-by-side speed of speculative decoding: a thin wrapper over ``headway.bench.benchmark``
(also ``headway bench``); see that module for the options and what it measures."""

# scripts/demo.py calls benchmark.main(argv) and benchmark.overall(results)
from headway.bench.benchmark import main, overall  # noqa: F401

if __name__ == "__main__":
    main()
