"""Legacy bookkeeping code: statement import, invoicing and monthly reports."""
