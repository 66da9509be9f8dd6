"""The dflash engine and the pieces every command shares."""
