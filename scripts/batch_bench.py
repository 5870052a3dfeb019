"""Batched speculative decoding against plain batched generate on the default target: a thin wrapper
over ``headway.bench.batch``; see that module for the options and what it prints."""

from headway.bench.batch import main

if __name__ == "__main__":
    main()
