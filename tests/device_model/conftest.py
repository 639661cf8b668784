"""Put this directory's helper modules (dm_*.py) on sys.path (importlib import mode)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
