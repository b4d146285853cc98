"""Boot tests: a real systemd (Debian trixie) booted in systemd-nspawn with our .deb."""
