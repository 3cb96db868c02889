"""What the tests and the benchmarks share: the test image store and stores made from it
(``images.py``), process groups (``processes.py``), versions with a new random layer made without a guest
(``fleetkit.py``), fault injection on real transfers and demand-paged runs (``faultproxy.py``,
``faultkit.py``, ``faultkills.py``, ``demandfaults.py``) and shaped links between network namespaces
(``netlink.py`` with its delaying proxy ``delayproxy.py``).

Layering: the kit imports the project's packages (``capsule``, ``hashcache``, ``diskserver``) and itself,
never ``tests`` or ``bench``: both of those import it, and a benchmark imports nothing from ``tests``.
"""
