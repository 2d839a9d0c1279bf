import time, platform
t = time.time()
import torch
t1 = time.time()
import torch_lowbit as tl
from torch_lowbit.ops import cpu_extension
t2 = time.time()
print(f"machine={platform.machine()} torch={torch.__version__} import torch {t1-t:.1f}s, import torch_lowbit {t2-t1:.1f}s")
c = cpu_extension()
print("extension:", c.__file__)
print("built_torch_version:", c.built_torch_version())
print("available_cpu_paths:", list(c.available_cpu_paths()))
