"""Put this directory's shared helper modules (header_probe.py) on sys.path (importlib
import mode)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
