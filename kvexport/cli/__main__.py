"""``python -m kvexport.cli``: the ``kvexport`` command."""

from kvexport.cli import main

main()
