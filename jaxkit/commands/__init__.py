"""One module per `jaxkit` command: its options (`add_parser`) and what it prints (`run`).

`jaxkit.cli` parses the line, starts JAX and hands over; the work itself is done by
importable modules (`jaxkit.plan.planning`, `jaxkit.train.loop`, `jaxkit.experiments`, ...).

May import: everything but cli (docs/how-it-is-built.md draws the layers).
"""
