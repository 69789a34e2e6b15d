"""Random parallel plans over many model families: each is refused with a named error or
trains like one device."""
