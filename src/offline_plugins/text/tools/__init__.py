"""Tools a multi-turn episode calls and where they run: the call format, the calculator and the Python
tool, the toolbox that runs a turn's calls (:mod:`~offline_plugins.text.tools.tools`), the sandboxes code
runs in (:mod:`~offline_plugins.text.tools.sandbox`) and how an episode goes on after a turn
(:mod:`~offline_plugins.text.tools.multiturn`: :class:`~offline_plugins.text.tools.multiturn.MultiTurn`,
``make_tools``)."""
