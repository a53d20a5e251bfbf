"""The ``apa`` commands, one module each: its options (``add_arguments``), its ``run``, its help
(``HELP``, and ``DESCRIPTION`` and ``EPILOG`` where they differ) and the result types of its study.
``cli`` lists them; ``common`` holds what they share. The package sits above the library: no library
module imports it."""
