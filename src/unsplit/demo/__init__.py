"""``unsplit demo``: one small model trained under several schedules, side by side.

An application built on the library, kept apart from its core:

* :mod:`unsplit.demo.config` -- the settings (importable before JAX starts);
* :mod:`unsplit.demo.data` -- the embedded character-level dataset;
* :mod:`unsplit.demo.train` -- the training loop and each schedule's update;
* :mod:`unsplit.demo.processes` -- the multi-process rows;
* :mod:`unsplit.demo.elastic` and :mod:`unsplit.demo.resume` -- the elastic row (killed, resumed
  on another topology);
* :mod:`unsplit.demo.run` -- runs every schedule and compares them;
* :mod:`unsplit.demo.progress` -- the progress bar's estimate;
* :mod:`unsplit.demo.report` -- the table, the JSON and the plot.

It uses only unsplit's public API (``unsplit``, ``unsplit.models``, ``unsplit.testing``,
``unsplit.data``, ``unsplit.checkpoint``). Run it with ``unsplit demo`` (``unsplit demo
--help`` lists the options; the default takes about 2 minutes on 2 CPU cores, ``--long``
trains a bigger model for longer).
"""
