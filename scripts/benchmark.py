"""Side-by-side speed of speculative decoding: a thin wrapper over ``headway.inference.benchmark``
(also ``headway bench``); see that module for the options and what it measures."""

from headway.inference.benchmark import main  # scripts/demo.py calls benchmark.main(argv)

if __name__ == "__main__":
    main()
