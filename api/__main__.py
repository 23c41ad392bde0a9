"""`python -m api` is the same as the `pagedserve` console script."""

from api.cli import main

if __name__ == "__main__":
    main()
