-- The regions view reads each region's latest report: an index on arrival time keeps that a range
-- scan over recent reports.
CREATE INDEX lease_reports_by_time ON lease_reports (received_at_ms);
