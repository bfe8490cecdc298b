"""``unsplit demo``: one small model trained under several schedules, side by side.

An application built on the library, kept apart from its core:

* :mod:`unsplit.demo.config` -- the settings (importable before JAX starts);
* :mod:`unsplit.demo.data` -- the embedded character-level dataset;
* :mod:`unsplit.demo.train` -- the training loop and each schedule's update;
* :mod:`unsplit.demo.processes` -- the multi-process rows;
* :mod:`unsplit.demo.run` -- runs every schedule and compares them;
* :mod:`unsplit.demo.report` -- the table, the JSON and the plot.

Run it with ``unsplit demo`` (``unsplit demo --help`` lists the options).
"""
