"""What a run needs from the machine: device and precision, the OS's probes (free memory, ranks)."""
