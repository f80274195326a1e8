"""The runner: `TorchBackend` (backend.py) turns the engine's `Batch` into one forward and a
sampled token per sequence, on the process's one device thread (device_thread.py), with the
step's inputs flattened (inputs.py) and staged into persistent buffers (staging.py), and, on
CUDA, decode steps replayed as captured graphs (cuda_graphs.py).

NOTE: this package module imports nothing: the model (model.py) imports `runner.inputs`, and
the backend imports the model.
"""
