"""What a run needs from the machine: device and precision, the memory of a training step, the OS's probes."""
