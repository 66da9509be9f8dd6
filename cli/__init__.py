"""The `dflash` command line."""
