"""The admin's commands, beside the daemon: audit, preflight, harden, rescue, status,
dump, check-config, release and doctor. The daemon never imports anything here."""
