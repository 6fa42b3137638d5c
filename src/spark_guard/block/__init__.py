"""A block: stop, mask, disable and verify a loader (blocker), the records that make it
undoable exactly (records), its undoing (release) and the login note (banner)."""
