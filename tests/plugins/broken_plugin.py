"""A provider plugin whose import fails, as when its native library is missing."""

raise ImportError("libvirtual_device.so: cannot open shared object file")
