"""Optional browser console; talks HTTP only."""
