"""Config files: each defines get_config(); `jaxkit train NAME` loads NAME.py from here."""
