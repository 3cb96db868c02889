"""The libvirt runtime: connection, domain XML, accelerator probe, console."""
