//! Page-granular mapped address ranges over a shared cache of physical device pages.
