"""One module per `jaxkit` command: its options (`add_parser`) and what it prints (`run`).

`jaxkit.cli` parses the line, starts JAX and hands over; the work itself is done by
importable modules (`jaxkit.planning`, `jaxkit.loop`, `jaxkit.experiments`, ...).
"""
