"""Guest programs (VM images name them as module:function) built on the runtime."""
