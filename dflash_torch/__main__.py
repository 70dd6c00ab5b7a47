"""``python -m dflash_torch``: the ``dflash-torch`` command line."""

from .cli import entry

if __name__ == "__main__":
    entry()
