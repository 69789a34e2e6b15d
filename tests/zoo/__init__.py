"""A zoo of models nobody on this project wrote, and the check of each under every policy."""
