"""A test worker that dies fails the run at once, naming the test it ran.

pytest-xdist 3.8 (the newest release here) replaces a dead worker under
`--dist=loadfile` and can then wait forever for work it never hands out
(pytest-xdist#1323, #1378): an abort in native code hung whole CI runs. So
unless `--max-worker-restart` is given, no worker is restarted. A hook
module of its own, so that a test can load it into a pytest run of its own
files (test_docs.py).
"""

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the option
def pytest_configure(config):
  if config.pluginmanager.hasplugin("xdist") and config.option.maxworkerrestart is None:
    config.option.maxworkerrestart = "0"
