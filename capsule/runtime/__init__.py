"""The libvirt runtime: connection, domain XML, accelerator probe, guest agent (the serial console:
``capsule.console.serial``)."""
